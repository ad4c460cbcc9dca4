"""ripplemesh: a control plane for LLM inference on a GPU fleet.

The public Python API is small: `MeshClient` submits requests over NATS and reads their token
streams; everything else is run through the `ripplemesh` command.
"""

from ripplemesh.client import Completion, MeshClient, MeshError

__all__ = ["Completion", "MeshClient", "MeshError"]
