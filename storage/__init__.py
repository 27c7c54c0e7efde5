"""The storage engine: how steps, policies and the learner's records live in a store.

    store.py       Store: a local folder, NFS or object storage through fsspec; atomic
                   commit, listing, confinement to the root, quarantine of bad shards
    archive.py     the archive's segments, manifests and ledgers (what each reader reads)
    compaction.py  moving the inbox into the archive, crash-safe at every step
    registry.py    the policy registry: versions, LATEST, publish and fetch, each confined
    delta.py       delta versions: a version as the XOR of its bits with its base's, checked
    policy_cache.py  the local cache of fetched versions, built whole and swept
    folders.py     folders written file by file (`.complete` last); the sharded commit
    retry.py       retries of transient object-store errors; disk-full detection
    files.py       atomic local writes (`atomic_write`, `build_once`)
    faults.py      named hold points for crash tests (GAGPO_HOLD)

Imports the contracts (gagpo.schemas) and nothing else of ours: no config model, no CLI.
Who compacts and when is the learner's (learner/compact.py); the store read as a library
is `gagpo.open_store`.
"""
