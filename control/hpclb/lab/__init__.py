"""The network-namespace lab: topology (:mod:`.topology`), the programs
its nodes run (:mod:`.node`), the appliance runner (:mod:`.appliance`), the
demo, the bench, BPF test runs and the DPDK telemetry client. The top floor:
nothing of the appliance imports it.
"""
