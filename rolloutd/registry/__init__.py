"""The weight registry: versions, their bytes, leases, the replica directory and demand.

Trainer side::

    from rolloutd.registry import EmbeddedRegistry, RegistryHTTP
"""

from rolloutd.registry.publish import EmbeddedRegistry, RegistryHTTP, VersionRefused

__all__ = ["EmbeddedRegistry", "RegistryHTTP", "VersionRefused"]
