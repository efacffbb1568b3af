"""The trainer's library: publish versions (in-process or over HTTP), demand them, and watch
the replicas; shards, publish handles, canaries and the integrations into trainer libraries.
The daemon never imports it.

    from rolloutd.trainer import EmbeddedRegistry, RegistryHTTP
"""

from rolloutd.trainer.publish import EmbeddedRegistry, RegistryHTTP, VersionRefused

__all__ = ["EmbeddedRegistry", "RegistryHTTP", "VersionRefused"]
