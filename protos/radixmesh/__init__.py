"""Generated code of the radixmesh protos; see scripts/gen_protos.py."""
