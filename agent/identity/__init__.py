"""Workload identity: names, keys and CSRs, the mesh PKI, TLS contexts.

- names.py: Identity(sa, ns, control_ns, trust_domain), DNS and SPIFFE forms (pure)
- csr.py: new_key, make_csr, check_csr -> CSRInfo, or CSRError(reason) (pure)
- chain.py: TrustBundle, load_trust_bundle, verify_chain (path checks)
- certs.py: lifetimes, renew_at, certificate builders, describe, key_type (pure)
- pki.py: create_root, create_issuer, inspect (the operator's PKI files)
- ca.py: load_issuer -> Issuer.sign_leaf; re-exports certs, pki and chain names
- files.py: PEM reading and writing; keys 0600, no overwrite without force
- tls.py: TLS 1.3 mTLS contexts from in-memory credentials; peer_identity
- options.py: flags of `meshagent certs`
"""
