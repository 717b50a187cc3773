"""radixmesh's client side: `radixmesh.lang`, the frontend language (docs/frontend_language.md).
It talks to a mesh over HTTP or gRPC like any client and imports nothing from services.*."""
