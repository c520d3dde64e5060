"""HTTP side of one pdserve server: FastAPI app, schemas, routes, engine client (scheduler IPC)."""
