"""What operators and other programs see: the CLI (which wires the faces to
the controller) and the Prometheus metrics; the REST API joins here.
"""
