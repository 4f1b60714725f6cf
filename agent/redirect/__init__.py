"""Traffic capture: iptables and eBPF redirects, and network-namespace helpers."""
