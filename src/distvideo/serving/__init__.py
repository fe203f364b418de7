"""`distvideo serve`: the HTTP video API (OpenAI's `/v1/videos` shape) over one engine on any executor (inline, mp, or
ranks started by torchrun, srun or mpirun). docs/serving.md describes it; server.py is where a reader starts."""
