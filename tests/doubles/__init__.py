"""Test doubles: model-free stand-ins for the mesh's parts (backends, replicas, workers) and harnesses that run them."""
