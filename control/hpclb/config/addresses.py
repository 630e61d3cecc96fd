"""An IP address field of the configuration, either family, with one error.

Shared by the schema and its sections (``bgp``), which the schema imports.
"""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address, ip_address
from typing import Annotated, Any

from pydantic import BeforeValidator


def ip_address_text(v: Any) -> Any:
    """Text -> IPv4Address or IPv6Address, with one error for both families
    (a plain union would report one per family)."""
    if isinstance(v, str):
        try:
            return ip_address(v.strip())
        except ValueError:
            raise ValueError("value is not a valid IPv4 or IPv6 address") from None
    return v


#: An address of either family, as the table contract carries it; which family
#: a field takes is checked across fields where it matters.
AnyAddress = Annotated[IPv4Address | IPv6Address, BeforeValidator(ip_address_text)]
