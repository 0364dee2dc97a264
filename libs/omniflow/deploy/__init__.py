"""Deployment descriptions rendered from the topology ``omniflow up`` reads.

``omniflow.deploy.k8s`` turns a :class:`omniflow.deploy.topology.Topology` into Kubernetes
objects (plain dicts, dumped as YAML by ``omniflow deploy k8s``); docs/deploy.md says what
each object is for and what was run or only validated.
"""
