"""Operator tools: the API client behind `lazarus status/nodes/events/...`, job submission and
the run report."""
