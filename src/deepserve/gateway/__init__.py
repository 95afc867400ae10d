"""The HTTP front door (request layer): OpenAI API, auth, validation, metrics.

It talks to the rest of the platform only by messages over ZeroMQ (see
link/job_client.py); it never imports engine/, worker/, model/ or control/.
Here: config, errors and metrics, which both sides share. Beside them: http/
(the HTTP side: app, server, generation, schemas, responses, OpenAPI, auth,
limits, contexts routes) and link/ (the ZeroMQ side: job client, JE link,
cluster view, reply routes and streams). http/ uses link/, never the reverse.
"""

from deepserve.gateway.http.app import create_app
from deepserve.gateway.http.server import serve
from deepserve.gateway.config import GatewayConfig

__all__ = ["GatewayConfig", "create_app", "serve"]
