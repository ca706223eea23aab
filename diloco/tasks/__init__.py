"""Thin Prefect @task wrappers over the engine: retries on transient storage errors, artifacts."""
