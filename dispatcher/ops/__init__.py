"""Operating gpulane: the `gpulane` command, the local supervisor (`gpulane up`) and its
embedded Redis, `gpulane status` and `gpulane submit`."""

__all__: list[str] = []
