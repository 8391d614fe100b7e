"""Starting pdmesh processes: free ports, network namespaces and (see docs/architecture.md) the launcher."""
