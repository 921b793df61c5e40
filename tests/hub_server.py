"""A small server speaking the Hugging Face Hub's HTTP API, on loopback, for tests.

No package on PyPI provides one that accepts uploads (`hf-local-hub`'s wheels ship only a client for a Go
binary they do not include; `olah` is a download mirror), so this implements the protocol that
`huggingface_hub` 2.x speaks when Xet is off (`HF_HUB_DISABLE_XET=1`; the Xet CAS protocol — chunked, compressed
xorbs and shards — is out of reach of a test server):

- repos: `POST /api/repos/create` (409 when it exists), `GET /api/models/{id}[/revision/{rev}]`,
  `GET /api/models/{id}/tree/{rev}[/{path}]`, `POST /api/models/{id}/branch/{name}`, `GET /api/models/{id}/refs`,
  `GET /api/whoami-v2`; private repos are invisible (401 RepoNotFound) without their owner's token.
- upload: `POST /api/models/{id}/preupload/{rev}` ("lfs" for `.gitattributes` LFS patterns and files of 10 MiB
  or more, with the remote oid for no-op detection), the git-LFS batch API `POST /{id}.git/info/lfs/objects/batch`
  (basic transfer, or the hub's multipart transfer for files over `multipart_threshold`: part URLs + completion
  URL), the LFS verify call, and the NDJSON commit `POST /api/models/{id}/commit/{rev}` (file, lfsFile,
  deletedFile, deletedFolder; parentCommit checked). Uploaded LFS objects are refused unless their sha256 and size
  match the oid.
- download: `HEAD/GET /{id}/resolve/{rev}/{path}` with `X-Repo-Commit` and `ETag` (the git blob id); LFS files
  answer 302 to a separate "CDN" origin with `X-Linked-Etag` (sha256) and `X-Linked-Size`, as the hub does.
- model card metadata: `POST /api/validate-yaml` (the client calls it before uploading a README.md).
- dataset repos (read only): `GET /api/datasets/{id}[/revision/{rev}]`, `.../tree/{rev}[/{path}]`,
  `HEAD/GET /datasets/{id}/resolve/{rev}/{path}`; a test puts one in place with `LocalHub.add_dataset`.
- errors carry the hub's `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound).

Every request is appended to `hub.requests` as (method, path, authorized) — never the token itself.
Run by hand: `python tests/hub_server.py --token hf_x --user me` prints the endpoint.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

# The hub's default .gitattributes for a new model repo (abridged to the patterns that matter here).
GITATTRIBUTES = "".join(
    f"{p} filter=lfs diff=lfs merge=lfs -text\n"
    for p in ("*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gz", "*.h5", "*.joblib", "*.gguf",
              "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet", "*.pb",
              "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors", "*.tar.*", "*.tflite", "*.tgz",
              "*.wasm", "*.xz", "*.zip", "*.zst", "*tfevents*")
)
LFS_SIZE = 10 * 1024 * 1024  # the hub stores any file of 10 MiB or more in LFS


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(oid: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


@dataclass
class Entry:
    size: int
    blob_id: str  # git blob id (of the pointer file for LFS files)
    lfs: str | None = None  # sha256 for LFS files


@dataclass
class Commit:
    files: dict[str, Entry]
    parent: str | None
    title: str
    date: str


@dataclass
class Repo:
    owner: str
    private: bool
    refs: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, commit: str | None = None, **body):
        super().__init__(message)
        self.status, self.code, self.commit, self.extra = status, code, commit, body


class LocalHub:
    """The hub's state (repos, git blobs, LFS objects) and its two loopback servers (API and "CDN")."""

    def __init__(self, root: Path, tokens: dict[str, str], multipart_threshold: int = 64 << 20,
                 chunk_size: int = 8 << 20):
        self.root = Path(root)
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        (self.root / "lfs").mkdir(exist_ok=True)
        (self.root / "parts").mkdir(exist_ok=True)
        self.tokens = tokens  # token -> user name ("*": may write to any namespace)
        self.multipart_threshold, self.chunk_size = multipart_threshold, chunk_size
        self.repos: dict[str, Repo] = {}
        self.lock = threading.RLock()
        self.requests: list[tuple[str, str, bool]] = []
        self.api = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, cdn=False))
        self.cdn = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, cdn=True))
        self.endpoint = f"http://127.0.0.1:{self.api.server_port}"
        self.cdn_endpoint = f"http://127.0.0.1:{self.cdn.server_port}"
        self._threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (self.api, self.cdn)]

    def __enter__(self) -> "LocalHub":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        for s in (self.api, self.cdn):
            s.shutdown()
            s.server_close()

    # ---- storage -------------------------------------------------------------------------------------------
    def put_blob(self, data: bytes) -> str:
        oid = git_blob_id(data)
        (self.root / "blobs" / oid).write_bytes(data)
        return oid

    def lfs_path(self, oid: str) -> Path:
        return self.root / "lfs" / oid

    def has_lfs(self, oid: str, size: int | None = None) -> bool:
        p = self.lfs_path(oid)
        return p.is_file() and (size is None or p.stat().st_size == size)

    def store_lfs(self, oid: str, source: Path) -> None:
        h = hashlib.sha256()
        with open(source, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        if h.hexdigest() != oid:
            source.unlink()
            raise HubError(400, f"sha256 of the uploaded content is {h.hexdigest()}, not {oid}")
        os.replace(source, self.lfs_path(oid))

    def commit(self, repo: Repo, branch: str, files: dict[str, Entry], parent: str | None, title: str,
               sha: str | None = None) -> str:
        date = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
        tree = json.dumps({p: [e.blob_id, e.lfs] for p, e in sorted(files.items())})
        sha = sha or hashlib.sha1(f"{tree}\n{parent}\n{title}\n{date}\n{uuid.uuid4()}".encode()).hexdigest()
        repo.commits[sha] = Commit(files, parent, title, date)
        repo.refs[branch] = sha
        return sha

    def create_repo(self, repo_id: str, owner: str, private: bool) -> None:
        repo = Repo(owner=owner, private=private)
        data = GITATTRIBUTES.encode()
        entry = Entry(len(data), self.put_blob(data))
        self.commit(repo, "main", {".gitattributes": entry}, None, "initial commit")
        self.repos[repo_id] = repo

    def add_dataset(self, repo_id: str, files: dict[str, bytes], sha: str | None = None) -> str:
        """A public dataset repo holding `files` (path -> bytes) at one commit, named `sha` when given (a test that
        pins a real dataset's revision serves it under that commit id); returns the commit id."""
        repo = Repo(owner=repo_id.split("/")[0], private=False)
        sha = self.commit(repo, "main", {p: Entry(len(d), self.put_blob(d)) for p, d in files.items()}, None,
                          "dataset", sha=sha)
        self.repos[f"datasets/{repo_id}"] = repo
        return sha

    def is_lfs_path(self, files: dict[str, Entry], path: str, size: int) -> bool:
        if size >= LFS_SIZE:
            return True
        attributes = files.get(".gitattributes")
        text = (self.root / "blobs" / attributes.blob_id).read_text() if attributes else ""
        name = path.rsplit("/", 1)[-1]
        for line in text.splitlines():
            parts = line.split()
            if len(parts) > 1 and "filter=lfs" in parts[1:] and (fnmatch.fnmatch(name, parts[0]) or fnmatch.fnmatch(path, parts[0])):
                return True
        return False


def _handler(hub: LocalHub, cdn: bool):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: tests read hub.requests instead
            pass

        # ---- plumbing ----------------------------------------------------------------------------------
        def user(self) -> str | None:
            auth = self.headers.get("Authorization", "")
            if not auth.startswith("Bearer "):
                return None
            token = auth[len("Bearer "):]
            if token not in hub.tokens:
                raise HubError(401, "Invalid credentials in Authorization header")
            return hub.tokens[token]

        def body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while True:
                    n = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if n == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return bytes(out)
                    out += self.rfile.read(n)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def body_to_file(self, path: Path) -> int:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                data = self.body()
                path.write_bytes(data)
                return len(data)
            left = int(self.headers.get("Content-Length") or 0)
            with open(path, "wb") as f:
                while left:
                    block = self.rfile.read(min(left, 1 << 20))
                    if not block:
                        break
                    f.write(block)
                    left -= len(block)
            return path.stat().st_size

        def send(self, status: int, payload=None, headers: dict | None = None, raw: bytes | None = None,
                 content_type: str = "application/json") -> None:
            data = raw if raw is not None else (b"" if payload is None else json.dumps(payload).encode())
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, str(v))
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def handle_any(self) -> None:
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.split("/")[1:]]
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            try:
                user = self.user()
                hub.requests.append((self.command, url.path, user is not None))
                routes = self.cdn_routes if cdn else self.api_routes
                with hub.lock:
                    routes(parts, query, user)
            except HubError as e:
                headers = {"X-Error-Message": str(e), "Connection": "close"}
                self.close_connection = True  # the request body may be unread: do not reuse the connection
                if e.code:
                    headers["X-Error-Code"] = e.code
                if e.commit:
                    headers["X-Repo-Commit"] = e.commit
                self.send(e.status, {"error": str(e), **e.extra}, headers)

        do_GET = do_HEAD = do_POST = do_PUT = handle_any

        # ---- lookups -----------------------------------------------------------------------------------
        def repo(self, repo_id: str, user: str | None, write: bool = False) -> Repo:
            repo = hub.repos.get(repo_id)
            if repo is None or (repo.private and user not in (repo.owner, "*")):
                raise HubError(401 if user is None else 404, "Repository not found", "RepoNotFound")
            if write and user not in (repo.owner, "*"):
                raise HubError(403, "You don't have the rights to write to this repository")
            return repo

        @staticmethod
        def head(repo: Repo, rev: str) -> str:
            if rev in repo.refs:
                return repo.refs[rev]
            if rev in repo.commits:
                return rev
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

        # ---- the API -----------------------------------------------------------------------------------
        def api_routes(self, parts: list[str], query: dict, user: str | None) -> None:
            method = self.command
            if parts[:2] == ["api", "whoami-v2"]:
                if user is None:
                    raise HubError(401, "Invalid credentials in Authorization header")
                return self.send(200, {"type": "user", "name": user, "auth": {"type": "access_token"}})
            if parts[:2] == ["api", "validate-yaml"] and method == "POST":
                return self.validate_yaml(json.loads(self.body()))
            if parts[:3] == ["api", "repos", "create"] and method == "POST":
                return self.create_repo(json.loads(self.body() or b"{}"), user)
            if len(parts) >= 4 and parts[:2] == ["api", "datasets"] and method == "GET":
                repo_id, rest = f"datasets/{parts[2]}/{parts[3]}", parts[4:]
                if not rest or (rest[:1] == ["revision"] and len(rest) == 2):
                    return self.info(repo_id, rest[1] if rest else "main", user)
                if rest[:1] == ["tree"] and len(rest) >= 2:
                    return self.tree(repo_id, rest[1], "/".join(rest[2:]), query, user)
            if len(parts) >= 6 and parts[0] == "datasets" and parts[3] == "resolve" and method in ("GET", "HEAD"):
                return self.resolve(f"datasets/{parts[1]}/{parts[2]}", parts[4], "/".join(parts[5:]), user)
            if len(parts) >= 4 and parts[:2] == ["api", "models"]:
                repo_id, rest = f"{parts[2]}/{parts[3]}", parts[4:]
                if method == "GET" and not rest:
                    return self.info(repo_id, "main", user)
                if method == "GET" and rest[:1] == ["revision"] and len(rest) == 2:
                    return self.info(repo_id, rest[1], user)
                if method == "GET" and rest[:1] == ["tree"] and len(rest) >= 2:
                    return self.tree(repo_id, rest[1], "/".join(rest[2:]), query, user)
                if method == "GET" and rest == ["refs"]:
                    repo = self.repo(repo_id, user)
                    branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": c} for b, c in repo.refs.items()]
                    return self.send(200, {"branches": branches, "tags": [], "converts": []})
                if method == "POST" and rest[:1] == ["preupload"] and len(rest) == 2:
                    return self.preupload(repo_id, rest[1], user)
                if method == "POST" and rest[:1] == ["commit"] and len(rest) == 2:
                    return self.commit(repo_id, rest[1], user)
                if method == "POST" and rest[:1] == ["branch"] and len(rest) == 2:
                    return self.branch(repo_id, rest[1], user)
            if len(parts) == 6 and parts[1].endswith(".git") and parts[2:5] == ["info", "lfs", "objects"]:
                repo_id = f"{parts[0]}/{parts[1][:-4]}"
                if parts[5] == "batch" and method == "POST":
                    return self.lfs_batch(repo_id, user)
                if parts[5] == "verify" and method == "POST":
                    obj = json.loads(self.body())
                    if not hub.has_lfs(obj["oid"], obj["size"]):
                        raise HubError(404, f"object {obj['oid']} not found")
                    return self.send(200, {"success": True})
            if parts[:1] == ["lfs-upload"]:
                return self.lfs_upload(parts[1:], user)
            if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
                return self.resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), user)
            raise HubError(404, f"no route for {method} /{'/'.join(parts)}")

        def create_repo(self, payload: dict, user: str | None) -> None:
            if user is None:
                raise HubError(401, "You must be authenticated to create a repository")
            if payload.get("type", "model") != "model":
                raise HubError(400, "this test hub only hosts model repos")
            owner = payload.get("organization") or user
            if user != "*" and owner != user:
                raise HubError(403, f"You don't have the rights to create a repository under {owner}")
            repo_id = f"{owner}/{payload['name']}"
            if repo_id in hub.repos:
                raise HubError(409, "You already created this model repo", url=f"{hub.endpoint}/{repo_id}")
            private = payload.get("visibility") == "private" or bool(payload.get("private"))
            hub.create_repo(repo_id, owner, private)
            self.send(200, {"url": f"{hub.endpoint}/{repo_id}", "name": repo_id, "id": repo_id})

        def validate_yaml(self, payload: dict) -> None:
            """The model card's metadata, checked as the hub does before an upload (the subset used here)."""
            import yaml

            errors, content = [], payload.get("content", "")
            meta = {}
            if content.startswith("---"):
                try:
                    meta = yaml.safe_load(content.split("---", 2)[1]) or {}
                except yaml.YAMLError as e:
                    errors.append(f"YAML front matter does not parse: {e}")
            if not isinstance(meta, dict):
                errors.append("metadata must be a mapping")
                meta = {}
            for key in ("tags", "base_model"):
                value = meta.get(key)
                items = value if isinstance(value, list) else [value] if value is not None else []
                if not all(isinstance(v, str) for v in items):
                    errors.append(f"\"{key}\" must be a string or a list of strings")
            for base in [meta.get("base_model")] if isinstance(meta.get("base_model"), str) else meta.get("base_model") or []:
                if isinstance(base, str) and base.count("/") != 1:
                    errors.append(f"\"base_model\" {base!r} is not a model id")
            if meta.get("base_model_relation") not in (None, "adapter", "merge", "quantized", "finetune"):
                errors.append("\"base_model_relation\" must be one of adapter, merge, quantized, finetune")
            for key in ("license", "library_name", "pipeline_tag"):
                if key in meta and not isinstance(meta[key], str):
                    errors.append(f"\"{key}\" must be a string")
            self.send(400 if errors else 200, {"errors": [{"message": m} for m in errors], "warnings": []})

        def info(self, repo_id: str, rev: str, user: str | None) -> None:
            repo = self.repo(repo_id, user)
            sha = self.head(repo, rev)
            commit = repo.commits[sha]
            repo_id = repo_id.removeprefix("datasets/")
            self.send(200, {"id": repo_id, "modelId": repo_id, "author": repo.owner, "sha": sha,
                            "private": repo.private, "lastModified": commit.date, "tags": [],
                            "siblings": [{"rfilename": p} for p in sorted(commit.files)]})

        def tree(self, repo_id: str, rev: str, prefix: str, query: dict, user: str | None) -> None:
            repo = self.repo(repo_id, user)
            sha = self.head(repo, rev)
            recursive = query.get("recursive", "False").lower() == "true"
            files = repo.commits[sha].files
            base = f"{prefix.rstrip('/')}/" if prefix else ""
            out, folders = [], set()
            for path in sorted(files):
                if not path.startswith(base):
                    continue
                rel = path[len(base):].split("/")
                for i in range(1, len(rel) if recursive else min(len(rel), 2)):
                    folders.add(base + "/".join(rel[:i]))
                if len(rel) > 1 and not recursive:
                    continue
                e = files[path]
                item = {"type": "file", "path": path, "size": e.size, "oid": e.blob_id}
                if e.lfs:
                    item["lfs"] = {"oid": e.lfs, "size": e.size, "pointerSize": len(lfs_pointer(e.lfs, e.size))}
                out.append(item)
            if prefix and not out and not folders:
                raise HubError(404, f"{prefix} not found", "EntryNotFound", sha)
            out += [{"type": "directory", "path": f, "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0}
                    for f in sorted(folders)]
            self.send(200, out)

        def branch(self, repo_id: str, name: str, user: str | None) -> None:
            repo = self.repo(repo_id, user, write=True)
            payload = json.loads(self.body() or b"{}")
            if name in repo.refs:
                raise HubError(409, f"Reference refs/heads/{name} already exists")
            repo.refs[name] = self.head(repo, payload.get("startingPoint") or "main")
            self.send(200, {})

        def preupload(self, repo_id: str, rev: str, user: str | None) -> None:
            repo = self.repo(repo_id, user, write=True)
            files = repo.commits[self.head(repo, rev)].files
            out = []
            for f in json.loads(self.body())["files"]:
                path, size = f["path"], int(f["size"])
                lfs = hub.is_lfs_path(files, path, size)
                current = files.get(path)
                oid = (current.lfs if lfs else current.blob_id) if current else None
                out.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
            self.send(200, {"files": out, "commitOid": repo.refs.get(rev)})

        def lfs_batch(self, repo_id: str, user: str | None) -> None:
            self.repo(repo_id, user, write=True)
            payload = json.loads(self.body())
            if payload.get("operation") != "upload":
                raise HubError(400, "this test hub accepts only LFS uploads through the batch API")
            transfers = payload.get("transfers") or ["basic"]
            objects, chosen = [], "basic"
            for obj in payload["objects"]:
                oid, size = obj["oid"], int(obj["size"])
                if hub.has_lfs(oid, size):
                    objects.append({"oid": oid, "size": size})  # already stored: no actions
                    continue
                verify = {"href": f"{hub.endpoint}/{repo_id}.git/info/lfs/objects/verify"}
                if size > hub.multipart_threshold and "multipart" in transfers:
                    chosen = "multipart"
                    upload_id = uuid.uuid4().hex
                    n = -(-size // hub.chunk_size)
                    header = {"chunk_size": str(hub.chunk_size)}
                    header.update({f"{i:05d}": f"{hub.endpoint}/lfs-upload/part/{upload_id}/{i}" for i in range(1, n + 1)})
                    upload = {"href": f"{hub.endpoint}/lfs-upload/complete/{upload_id}/{oid}", "header": header}
                else:
                    upload = {"href": f"{hub.endpoint}/lfs-upload/basic/{oid}"}
                objects.append({"oid": oid, "size": size, "authenticated": True,
                                "actions": {"upload": upload, "verify": verify}})
            self.send(200, {"transfer": chosen, "objects": objects, "hash_algo": "sha256"},
                      content_type="application/vnd.git-lfs+json")

        def lfs_upload(self, parts: list[str], user: str | None) -> None:
            kind = parts[0]
            if kind == "basic" and self.command == "PUT":
                tmp = hub.root / "parts" / uuid.uuid4().hex
                self.body_to_file(tmp)
                hub.store_lfs(parts[1], tmp)
                return self.send(200, {})
            if kind == "part" and self.command == "PUT":
                part = hub.root / "parts" / f"{parts[1]}.{int(parts[2]):05d}"
                self.body_to_file(part)
                return self.send(200, {}, {"ETag": f'"{hashlib.md5(part.read_bytes()).hexdigest()}"'})
            if kind == "complete" and self.command == "POST":
                upload_id, oid = parts[1], parts[2]
                payload = json.loads(self.body())
                tmp = hub.root / "parts" / f"{upload_id}.joined"
                with open(tmp, "wb") as out:
                    for p in sorted(payload["parts"], key=lambda p: p["partNumber"]):
                        part = hub.root / "parts" / f"{upload_id}.{p['partNumber']:05d}"
                        data = part.read_bytes()
                        if f'"{hashlib.md5(data).hexdigest()}"' != p["etag"]:
                            raise HubError(400, f"part {p['partNumber']}: etag mismatch")
                        out.write(data)
                        part.unlink()
                hub.store_lfs(oid, tmp)
                return self.send(200, {})
            raise HubError(404, "unknown LFS upload route")

        def commit(self, repo_id: str, rev: str, user: str | None) -> None:
            repo = self.repo(repo_id, user, write=True)
            if rev not in repo.refs:
                raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            lines = [json.loads(line) for line in self.body().splitlines() if line.strip()]
            if not lines or lines[0].get("key") != "header":
                raise HubError(400, "the first NDJSON line must be the commit header")
            header = lines[0]["value"]
            parent = repo.refs[rev]
            if header.get("parentCommit") not in (None, parent):
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            files = dict(repo.commits[parent].files)
            for line in lines[1:]:
                key, value = line["key"], line["value"]
                path = value["path"]
                if key == "file":
                    data = base64.b64decode(value["content"])
                    files[path] = Entry(len(data), hub.put_blob(data))
                elif key == "lfsFile":
                    oid = value["oid"]
                    if value.get("algo", "sha256") != "sha256" or not hub.has_lfs(oid):
                        raise HubError(422, f"LFS object {oid} for {path} was never uploaded")
                    size = hub.lfs_path(oid).stat().st_size
                    files[path] = Entry(size, git_blob_id(lfs_pointer(oid, size)), lfs=oid)
                elif key == "deletedFile":
                    if files.pop(path, None) is None:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                elif key == "deletedFolder":
                    files = {p: e for p, e in files.items() if not p.startswith(path.rstrip("/") + "/")}
                else:
                    raise HubError(400, f"unknown commit operation {key}")
            sha = hub.commit(repo, rev, files, parent, header.get("summary") or "update")
            self.send(200, {"success": True, "commitOid": sha, "commitUrl": f"{hub.endpoint}/{repo_id}/commit/{sha}",
                            "commitMessage": header.get("summary"), "pullRequestUrl": None})

        def resolve(self, repo_id: str, rev: str, path: str, user: str | None) -> None:
            repo = self.repo(repo_id, user)
            sha = self.head(repo, rev)
            entry = repo.commits[sha].files.get(path)
            if entry is None:
                raise HubError(404, f"{path} does not exist at {rev}", "EntryNotFound", sha)
            headers = {"X-Repo-Commit": sha, "ETag": f'"{entry.blob_id}"', "Accept-Ranges": "bytes"}
            if entry.lfs:  # the hub redirects LFS files to its CDN, with their metadata on the redirect
                headers.update({"X-Linked-Etag": f'"{entry.lfs}"', "X-Linked-Size": entry.size,
                                "Location": f"{hub.cdn_endpoint}/lfs/{entry.lfs}?name={quote(path)}"})
                return self.send(302, raw=b"", headers=headers)
            self.send_file(hub.root / "blobs" / entry.blob_id, headers)

        def send_file(self, path: Path, headers: dict) -> None:
            data = path.read_bytes()
            status, rng = 200, self.headers.get("Range")
            if rng and rng.startswith("bytes="):
                start, _, end = rng[len("bytes="):].partition("-")
                first, last = int(start or 0), int(end) if end else len(data) - 1
                headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
                data, status = data[first:last + 1], 206
            self.send(status, raw=data, headers=headers, content_type="application/octet-stream")

        # ---- the "CDN" ---------------------------------------------------------------------------------
        def cdn_routes(self, parts: list[str], query: dict, user: str | None) -> None:
            if len(parts) == 2 and parts[0] == "lfs" and self.command in ("GET", "HEAD") and hub.has_lfs(parts[1]):
                return self.send_file(hub.lfs_path(parts[1]), {"ETag": f'"{parts[1]}"', "Accept-Ranges": "bytes"})
            raise HubError(404, "not found")

    return Handler


# ---- a test's client side: the token the hub knows, the environment a user's shell would hold, a download ----
TOKEN = "hf_surgeryTestToken_0123456789abcdef"
USER = "alice"


def hub_env(hub: LocalHub, tmp_path: Path, token: str | None = TOKEN) -> dict:
    """What a user's shell would hold: the endpoint, a token (or none), a private cache; Xet off (see hub_server)."""
    return {"HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0",
            "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_TOKEN": token or ""}


def run_script(hub: LocalHub, tmp_path: Path, script: Path, *args) -> dict:
    """Run a notebook-like Python script against the loopback hub (this checkout's toolkit on its path, a private
    surgery cache), as a user's process would; its last stdout line, parsed as JSON."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), SURGERY_CACHE=str(tmp_path / "cache"),
               **hub_env(hub, tmp_path))
    result = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def download(hub: LocalHub, repo_id: str, cache: Path, token: str | None = TOKEN, revision: str | None = None) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, endpoint=hub.endpoint, token=token or False, cache_dir=cache,
                                  revision=revision))


if __name__ == "__main__":
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--token", required=True)
    parser.add_argument("--user", required=True)
    args = parser.parse_args()
    with LocalHub(Path(tempfile.mkdtemp(prefix="hub-")), {args.token: args.user}) as hub:
        print(f"HF_ENDPOINT={hub.endpoint}  HF_HUB_DISABLE_XET=1", flush=True)
        threading.Event().wait()
