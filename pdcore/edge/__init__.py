"""The HTTP edge that the servers and the router share: what every request meets before a route
sees it. `schemas` (the wire bodies, strict numbers), `unsupported` (fields refused by name),
`limits` (body size, JSON depth, each route's body checked against its schema), `auth`
(--api-key and the admin-route guard), `connections` and `guarded_http` (the ports' header and
body deadlines and connection caps, uvicorn's protocol class), `tracing` (OpenTelemetry spans and
`traceparent`). One mechanism for both users; neither owns it."""
