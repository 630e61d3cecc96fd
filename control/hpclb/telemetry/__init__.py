"""What node agents report: the message and its codec (:mod:`.message`, also
used by the agent) and the CURVE-authenticated receiver (:mod:`.receiver`).
"""
