"""`sedax certs`: a development CA and certificates for brokers and clients, bearer tokens (net/certs.py).

    sedax certs init  --dir DIR                                   # DIR/ca.pem, DIR/ca.key
    sedax certs issue --dir DIR --name n0 --role broker [--host H]  # DIR/n0.pem, DIR/n0.key
    sedax certs issue --dir DIR --name meter-7 --role client
    sedax certs token --dir DIR --name dashboard                  # prints a token, stores its digest
    sedax certs crl --dir DIR                                     # DIR/crl.pem, for brokers' --tls-crl
    sedax certs revoke --dir DIR --name meter-7                   # revokes DIR/meter-7.pem, writes DIR/crl.pem

Exit codes: 0 done, 2 a usage problem or a failed openssl call (the message says which).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cli.args import EXIT_USAGE, fail
from net.certs import CA_DAYS, CRL_DAYS, LEAF_DAYS


def _cmd(args: argparse.Namespace) -> int:
    from net import certs

    try:
        if args.action == "init":
            path = certs.init_ca(args.dir, force=args.force, days=args.days or CA_DAYS)
            print(f"CA certificate {path}; its key {certs.ca_paths(args.dir)[1]} signs every certificate: keep it safe")
        elif args.action == "issue":
            if not args.name or not args.role:
                raise certs.CertError("issue needs --name NAME and --role broker|client")
            days = args.days or LEAF_DAYS
            cert, key = certs.issue(args.dir, args.name, args.role, args.host or (), force=args.force, days=days)
            print(f"{args.role} certificate {cert} (key {key}) for {args.name!r}")
            if args.role == "broker":
                ca = certs.ca_paths(args.dir)[0]
                print(f"run: sedax broker --node-id {args.name} --tls-cert {cert} --tls-key {key} --tls-ca {ca} ...")
                if args.force:
                    print(f"a broker already running with {cert} takes the new one at `kill -HUP <its pid>`")
        elif args.action in ("crl", "revoke"):
            days = args.days or CRL_DAYS
            if args.action == "crl":
                path = certs.write_crl(args.dir, days=days)
                print(f"CRL {path}, valid for {days} days: write it again before then (sedax certs crl)")
            else:
                if not args.name:
                    raise certs.CertError("revoke needs --name NAME (the certificate DIR/NAME.pem)")
                path = certs.revoke(args.dir, args.name, days=days)
                print(f"revoked {args.name!r}; CRL {path}, valid for {days} days")
            print(
                f"brokers given --tls-crl {path} read it again at `kill -HUP <pid>` and then close the connections of "
                "the certificates it revokes"
            )
        else:
            if not args.name:
                raise certs.CertError("token needs --name NAME (the identity the token authenticates as)")
            token, path = certs.add_token(args.dir, args.name)
            print(token)
            note = (
                f"token for {args.name!r}; its digest is in {path} (pass --tokens {path} to brokers; running ones "
                "read it again at `kill -HUP <pid>`)"
            )
            print(note, file=sys.stderr)
    except certs.CertError as exc:
        return fail(str(exc), EXIT_USAGE)
    return 0


def _days(text: str) -> int:
    try:
        days = int(text)
    except ValueError:
        days = 0
    if not 1 <= days <= 36500:
        raise argparse.ArgumentTypeError(f"--days must be a whole number of days from 1 to 36500, got {text!r}")
    return days


def register(subparsers: Any) -> None:
    """Add the certs subcommand."""
    p = subparsers.add_parser(
        "certs", help="create a development CA, broker and client certificates, or tokens (needs openssl)"
    )
    p.add_argument(
        "action",
        choices=("init", "issue", "token", "crl", "revoke"),
        help="init: a new CA; issue: a certificate; token: a client token; crl: the CA's revocation list; revoke: a "
        "certificate (and write the list)",
    )
    p.add_argument("--dir", required=True, help="certificate directory (created 0700)")
    p.add_argument("--name", help="issue/token/revoke: the identity (a broker's node id, a client's ACL name)")
    p.add_argument("--role", choices=("broker", "client"), help="issue: what the certificate may do")
    p.add_argument(
        "--host", action="append", help="issue, broker: an extra IP or DNS name the broker is reached at (repeatable)"
    )
    p.add_argument("--force", action="store_true", help="replace an existing CA or certificate")
    p.add_argument(
        "--days",
        type=_days,
        help=f"how long the certificate or CRL is valid (CA {CA_DAYS}, certificates {LEAF_DAYS}, CRL {CRL_DAYS})",
    )
    p.set_defaults(func=_cmd)
