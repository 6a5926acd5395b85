#!/usr/bin/env python3
"""check_template.py - render the chat-template table with jinja2 and compare with stepd's C.

Renders every case of data/chat_cases.json with the Step-3.7 Jinja template in the same
environment transformers' apply_chat_template builds (ImmutableSandboxedEnvironment,
trim_blocks, lstrip_blocks, loopcontrols, tojson = json.dumps(ensure_ascii=False)) plus the
fromjson filter the template uses (json.loads).  Template source: --template FILE, or the
chat_template of a tokenizer_config.json given with --config.

  --write   store each rendering as the case's "expected" (what test-tok-chat compares)
  --cli B   also run `B chat CASES` (the C renderer) and compare byte for byte
Exit status 0 only if every comparison matched.
"""
import argparse
import json
import subprocess
import sys

try:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:
    print('SKIP: jinja2 is not installed')
    sys.exit(77)


def make_env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.filters['tojson'] = tojson
    env.filters['fromjson'] = json.loads
    env.globals['raise_exception'] = raise_exception
    return env


def render(tpl, case):
    kw = dict(messages=case['messages'], tools=case.get('tools'),
              bos_token=case.get('bos_token', '<｜begin▁of▁sentence｜>'),
              add_generation_prompt=case.get('add_generation_prompt', False))
    for k in ('reasoning_effort', 'preserve_thinking'):
        if k in case:
            kw[k] = case[k]
    return tpl.render(**kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--cases', required=True)
    ap.add_argument('--template')
    ap.add_argument('--config')
    ap.add_argument('--write', action='store_true')
    ap.add_argument('--cli')
    a = ap.parse_args()
    if a.config:
        src = json.load(open(a.config))['chat_template']
    else:
        src = open(a.template, encoding='utf-8').read()
    tpl = make_env().from_string(src)
    cases = json.load(open(a.cases, encoding='utf-8'))
    bad = 0
    outs = [render(tpl, c) for c in cases]
    for c, out in zip(cases, outs):
        if not a.write and 'expected' in c and c['expected'] != out:
            print('MISMATCH jinja vs stored expected: %s' % c['name'])
            bad += 1
    if a.cli:
        res = subprocess.run([a.cli, 'chat', a.cases], capture_output=True, check=True)
        ours = json.loads(res.stdout.decode('utf-8'))
        for c, out, mine in zip(cases, outs, ours):
            if out != mine:
                bad += 1
                k = next((i for i, (x, y) in enumerate(zip(out, mine)) if x != y),
                         min(len(out), len(mine)))
                print('MISMATCH C vs jinja: %s at char %d:\n  jinja: %r\n  C:     %r' %
                      (c['name'], k, out[max(0, k - 40):k + 40], mine[max(0, k - 40):k + 40]))
        if len(ours) != len(cases):
            bad += 1
    if a.write:
        for c, out in zip(cases, outs):
            c['expected'] = out
        with open(a.cases, 'w', encoding='utf-8') as f:
            f.write('[\n' + ',\n'.join(' ' + json.dumps(c, ensure_ascii=False) for c in cases)
                    + '\n]\n')
    print('%s: %d conversations, %d mismatches' % ('OK' if not bad else 'FAIL', len(cases), bad))
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
