"""The discrete-event simulator driver (installed as `hicache.sim`).

It runs the same core as a real decode node against cost models of GPUs, links and storage.
It never imports `hicache.runtime`, trio or torch.
"""
