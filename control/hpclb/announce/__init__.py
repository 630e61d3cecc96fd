"""BGP announcements of the VIPs through a BGP speaker (BIRD 2), a separate
service: what to announce (:mod:`.decision`, with flap damping,
:mod:`.damping`), BIRD's configuration and control socket (:mod:`.bird`), and
the :class:`~.speaker.Speaker` the controller drives. This floor sits beside
health and telemetry: it imports config, host and contract, and only the
controller imports it.
"""
