"""The HTTP front door (request layer): OpenAI API, auth, validation, metrics.

It talks to the rest of the platform only by messages over ZeroMQ (see
job_client.py); it never imports engine/, worker/, model/ or control/.
"""

from deepserve.gateway.app import create_app
from deepserve.gateway.server import serve
from deepserve.gateway.config import GatewayConfig

__all__ = ["GatewayConfig", "create_app", "serve"]
