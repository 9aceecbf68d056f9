"""Plain helpers shared by several test modules, one module per subject (no fixtures: those live in
conftest.py, where pytest finds them without an import; the tiny-target builders are in tiny.py, the
test-only oracles in oracles.py).

Test modules import from here, never from conftest.py or from one another (tests/test_layers.py checks it).
"""
