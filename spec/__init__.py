"""kvlease's protocol specification and conformance vectors, as package data.

This directory (``spec/`` in the source tree, where they are edited) installs as the package
``kvlease.spec``, so an installed kvlease carries ``PROTOCOL.md``, ``CHANGES.md`` and the
language-neutral vectors (``vectors/*.json`` and their ``README.md``). Read them through
``importlib.resources.files("kvlease.spec")``; ``kvlease conformance`` does. Nothing here is code.
"""
