"""gpulane's dispatcher: the HTTP API, admission, the Redis contract, metrics, the
client and the `gpulane` command. It never imports GPU libraries or task code.

Kept import-light: workers import its Redis contract, and must not pay for the HTTP
client; ``from dispatcher import Client`` loads it on first use.
"""

from typing import Any

__all__ = ["AsyncClient", "Client", "GpulaneError", "__version__"]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("AsyncClient", "Client", "GpulaneError"):
        from dispatcher import client

        return getattr(client, name)
    raise AttributeError(name)
