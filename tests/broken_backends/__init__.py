"""Deliberately broken backends: each is kvref with exactly one bug.

``tests/test_conformance.py`` runs the conformance suite on each of them and
asserts that it fails, proving that the suite catches that class of bug.
Every module exposes ``factory()`` returning a ``kvspec.conformance.Backend``,
so a single one can be run by hand::

    python -m pytest --pyargs kvspec.conformance \\
        --kv-backend=tests.broken_backends.off_by_one_slot_mapping:factory -x
"""
