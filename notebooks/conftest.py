"""nbval runs a notebook's cells in order on one kernel, so under pytest-xdist its
cells must go to one worker together; the other worker runs other tests meanwhile.
(xdist's own `--dist loadgroup` reads groups from node ids, which pytest >= 9.2 no
longer lets a plugin rename.)"""


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class NotebookScheduling(LoadScopeScheduling):
        """Each test a work unit of its own, except a notebook's cells: one unit."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.endswith(".ipynb") else nodeid

    return NotebookScheduling(config, log)
