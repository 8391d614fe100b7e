"""Stand-ins used by the benches and the tests: fake gRPC and SGLang workers, a raw worker client, tiny HF checkpoints, random JSON schemas."""
