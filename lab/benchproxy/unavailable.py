"""Why a contender of a benchmark cannot run here: raised by the routers' starters and by
the peers' virtualenv, caught where a run goes on without that contender."""


class Unavailable(Exception):
    """This contender cannot run here; the message says why."""
