"""Shared by the Kineto fast-path tests (test_kineto_fast_paths.py, test_kineto_tokens.py)."""

import pytest


@pytest.fixture(scope="session")
def refuse_python():
    """``refuse_python(monkeypatch)``: makes a fall back to the Python reader fail the test (the
    comparison with it is not vacuous)."""
    from vmalloc.traces import kineto

    def refuse_in(monkeypatch):
        def refuse(self, *args):
            raise AssertionError("fell back to the Python reader")
            yield

        monkeypatch.setattr(kineto.KinetoReader, "records", refuse)
        monkeypatch.setattr(kineto, "JsonEventScanner", refuse)

    return refuse_in
