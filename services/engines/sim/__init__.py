"""The sim engine: a roofline performance model of a GPU serving a model, with a paged KV cache,
prefix caching and continuous batching. Runs on the real clock in the mesh (optionally sped up)
and on a virtual clock in the simulator, with the same code."""
