"""Host provisioning: ``python -m hpclb.provision {gateway,node,client,prepare}``.

A plan of idempotent actions (:mod:`hpclb.provision.plan`), run by
``appliance/provision.sh`` after its bash steps (packages, the tree in
/opt/hpclb, the build). This package sits on the floor of ``hpclb.lab``: it
may import faces, config, host and contract; only ``hpclb.main`` imports it.
"""
