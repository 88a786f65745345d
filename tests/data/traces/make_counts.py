#!/usr/bin/env python3
"""Write <trace>.counts.txt next to each trace: facts the pickle tests check
cca's reader against (events per action, sums, segment count, top-level keys),
one "name value" per line.
Run from anywhere: python3 tests/data/traces/make_counts.py"""
import collections, gzip, os, pickle

here = os.path.dirname(os.path.abspath(__file__))
for name in sorted(os.listdir(here)):
    if not name.endswith('.pickle.gz'):
        continue
    with gzip.open(os.path.join(here, name)) as f:
        snap = pickle.load(f)
    events = snap['device_traces'][0]
    by_action = collections.Counter(e['action'] for e in events)
    facts = {
        'top_keys': ','.join(snap.keys()),
        'events': len(events),
        'alloc_size_sum': sum(e['size'] for e in events if e['action'] == 'alloc'),
        'max_addr': max((e.get('addr', 0) for e in events), default=0),
        'segments': len(snap['segments']),
        'blocks': sum(len(s['blocks']) for s in snap['segments']),
        'stats_keys': len(snap['cca_meta']['final_memory_stats']),
        'peak_reserved': snap['cca_meta']['final_memory_stats'].get('reserved_bytes.all.peak', 0),
        'summary_len': len(snap['cca_meta']['final_memory_summary'].encode('utf-8')),
    }
    for action, n in sorted(by_action.items()):
        facts['action.' + action] = n
    out = os.path.join(here, name.replace('.pickle.gz', '.counts.txt'))
    with open(out, 'w') as f:
        for k, v in facts.items():
            f.write('%s %s\n' % (k, v))
