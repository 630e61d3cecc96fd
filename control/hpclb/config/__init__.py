"""The appliance's configuration: the models (:mod:`.schema`), the YAML loader
whose errors name file, line and field (:mod:`.loader`), and the per-pool
models of the probes (:mod:`.probes`), of the weight formula
(:mod:`.weights`) and of tunnel mode's settings (:mod:`.tunnel`). This
floor imports only the contract beneath it.
"""

from __future__ import annotations

from hpclb.config.document import ConfigDocument, EditError
from hpclb.config.fleet import FleetConfig
from hpclb.config.loader import (
    MAX_CONFIG_BYTES,
    ConfigError,
    ConfigIssue,
    load_config,
    parse_config,
    read_config_text,
)
from hpclb.config.schema import (
    DEFAULT_TELEMETRY_PORT,
    PCI_ADDRESS,
    AdminState,
    ApiConfig,
    ApplianceConfig,
    BackendConfig,
    ConnTimeouts,
    Dataplane,
    DpdkConfig,
    DpdkDriver,
    ForwardingMode,
    HpclbConfig,
    IfName,
    InterfacesConfig,
    Loc,
    Name,
    NatConfig,
    NatDownPolicy,
    NumaPolicy,
    PoolConfig,
    PortRange,
    SnatConfig,
    TelemetryConfig,
    VipConfig,
    VipProtocol,
    WeightsMode,
    XdpConfig,
    XdpMode,
)
from hpclb.config.tunnel import TunnelConfig, TunnelEncap

__all__ = [
    "DEFAULT_TELEMETRY_PORT",
    "MAX_CONFIG_BYTES",
    "PCI_ADDRESS",
    "AdminState",
    "ApiConfig",
    "ApplianceConfig",
    "BackendConfig",
    "ConfigDocument",
    "ConfigError",
    "ConfigIssue",
    "ConnTimeouts",
    "Dataplane",
    "DpdkConfig",
    "DpdkDriver",
    "EditError",
    "FleetConfig",
    "ForwardingMode",
    "HpclbConfig",
    "IfName",
    "InterfacesConfig",
    "Loc",
    "Name",
    "NatConfig",
    "NatDownPolicy",
    "NumaPolicy",
    "PoolConfig",
    "PortRange",
    "SnatConfig",
    "TelemetryConfig",
    "TunnelConfig",
    "TunnelEncap",
    "VipConfig",
    "VipProtocol",
    "WeightsMode",
    "XdpConfig",
    "XdpMode",
    "load_config",
    "parse_config",
    "read_config_text",
]
