"""hpclb: a load-balancing appliance for HPC clusters."""

__version__ = "0.1.0"
