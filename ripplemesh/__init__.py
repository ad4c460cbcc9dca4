"""ripplemesh: a control plane for LLM inference on a GPU fleet.

The public Python API is small: `MeshClient` submits requests over NATS and reads their token
streams, as a tenant whose credentials `load_credentials` reads (the file `ripplemesh up`
writes); `Subscriber` adds your own service to the event stream (ripplemesh/subscriber.py,
docs/subscribers.md); everything else is run through the `ripplemesh` command.
"""

from ripplemesh.client import Completion, MeshClient, MeshError, MeshUnavailable
from ripplemesh.subscriber import Context, PermanentError, Subscriber, run_subscribers
from services.mesh.nats_auth import NatsCredentials, load_credentials

__all__ = [
    "Completion",
    "Context",
    "MeshClient",
    "MeshError",
    "MeshUnavailable",
    "NatsCredentials",
    "PermanentError",
    "Subscriber",
    "load_credentials",
    "run_subscribers",
]
