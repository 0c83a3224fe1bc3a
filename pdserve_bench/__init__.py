"""pdserve's benchmarks behind one command, `pdserve-bench` (or `python -m pdserve_bench`).

The bench may import the product packages (server, kvcache, transceiver); nothing there imports it.
"""
