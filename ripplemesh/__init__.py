"""ripplemesh: a control plane for LLM inference on a GPU fleet.

The public Python API is small: `MeshClient` submits requests over NATS and reads their token
streams, as a tenant whose credentials `load_credentials` reads (the file `ripplemesh up`
writes); everything else is run through the `ripplemesh` command.
"""

from ripplemesh.client import Completion, MeshClient, MeshError, MeshUnavailable
from services.mesh.nats_auth import NatsCredentials, load_credentials

__all__ = ["Completion", "MeshClient", "MeshError", "MeshUnavailable", "NatsCredentials", "load_credentials"]
