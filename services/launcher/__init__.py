"""Running the mesh: `radixmesh serve <service>`, `radixmesh up`, `radixmesh healthcheck`."""
