"""Datasets: registry, download, canonical schemas, synthetic tiny tasks."""
