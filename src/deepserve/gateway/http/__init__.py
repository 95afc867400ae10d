"""The gateway's HTTP side: the FastAPI app and its uvicorn server, the OpenAI
request bodies and responses, one generation request's flow, auth, the body and
connection limits, contexts routes and the API's OpenAPI description."""
