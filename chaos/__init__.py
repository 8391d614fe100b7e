"""The chaos soak (docs/chaos.md): `python -m chaos.soak`."""
