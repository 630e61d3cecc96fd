"""The host the appliance runs on: network namespaces, the neighbour table,
the build outputs it was installed with, and the asyncio loop that runs in a
thread inside a namespace. Imports only the contract beneath it.
"""
