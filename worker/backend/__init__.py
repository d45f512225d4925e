"""Backend workers: a worker that fronts an OpenAI-compatible inference server (vLLM,
TGI, SGLang, llama.cpp's server, Infinity) instead of running handlers in-process."""
