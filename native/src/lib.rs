//! cachefsd's data plane, as the Python module `cachefsd._native`: the
//! kernel's FUSE requests read and, where the cache already holds the
//! answer, answered on native threads, without the GIL.
//!
//! The seam is two classes (typed in `cachefsd/_native.pyi`):
//!
//! - `Tables`, what the kernel knows of a mount (`tables.rs`): Python holds
//!   each inode it hands the kernel and names the verified cache files of
//!   its blocks; it drains, in batches, the reads served here, the inodes
//!   gone and the requests answered (`reports.rs`);
//! - `Session`, the native workers of one mount (`session.rs`): Python
//!   takes from it the requests only Python answers, one a call, sets how
//!   OPEN is answered, and opens and releases through it the files the
//!   native workers did not (the passthrough rules of `opens.rs` are one
//!   table for both).
//!
//! Every call that may wait releases the GIL. `abi`, the decoding of the
//! kernel's requests, is public for the fuzz target (`fuzz/`).

pub mod abi;
mod device;
mod opens;
mod reports;
mod session;
mod tables;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::abi::Attr;
use crate::opens::{Begin, Opened};
use crate::reports::Reports;
use crate::session::OpenMode;
use crate::tables::{BlockFile, FileIdentity, Listed};

/// `protocol.Attr`'s fields, in order: ino, size, mtime, mode, nlink, uid, gid.
type AttrFields = (u64, u64, f64, u32, u32, u32, u32);
/// A block's verified raw file: index, path, offset of the block in it,
/// the file's device, inode and ctime (ns), and its tier's name.
type BlockFileFields = (u64, PathBuf, u64, u64, u64, i64, String);
/// A listing's entry: name, inode, attributes, cacheable.
type ListedFields = (Vec<u8>, u64, AttrFields, bool);
/// A version's whole verified raw file: path, the file's device, inode and
/// ctime (ns), and its tier's name.
type WholeFields = (PathBuf, u64, u64, i64, String);
/// A read served natively: inode, offset, size, pid, bytes by tier, seconds.
type ReadFields = (u64, u64, u64, u32, Vec<(String, u64)>, f64);
/// An open served natively in passthrough: inode, pid, tier.
type OpenFields = (u64, u32, String);
/// What `Tables.drain` returns: reads, passthrough opens, inodes gone,
/// requests answered by operation.
type Drained = (
    Vec<ReadFields>,
    Vec<OpenFields>,
    Vec<u64>,
    Vec<(&'static str, u64)>,
);

fn attr((ino, size, mtime, mode, nlink, uid, gid): AttrFields) -> Attr {
    Attr {
        ino,
        size,
        mtime,
        mode,
        nlink,
        uid,
        gid,
    }
}

#[pyclass(frozen, name = "Tables", module = "cachefsd._native")]
struct PyTables {
    tables: Arc<tables::Tables>,
    /// What the native workers did, for `drain`.
    reports: Arc<Reports>,
}

#[pymethods]
impl PyTables {
    #[new]
    fn new(ttl_seconds: f64) -> PyResult<Self> {
        let ttl = Duration::try_from_secs_f64(ttl_seconds)
            .map_err(|error| PyValueError::new_err(error.to_string()))?;
        Ok(PyTables {
            tables: Arc::new(tables::Tables::new(ttl, Instant::now())),
            reports: Arc::new(Reports::default()),
        })
    }

    /// One more reference to `inode`; the inodes gone as its name moved to it.
    fn hold(
        &self,
        inode: u64,
        parent: u64,
        name: &[u8],
        attributes: AttrFields,
        cacheable: bool,
    ) -> Vec<u64> {
        let mut gone = Vec::new();
        let now = Instant::now();
        self.tables.hold(
            inode,
            parent,
            name,
            attr(attributes),
            cacheable,
            now,
            &mut gone,
        );
        gone
    }

    fn forget(&self, inode: u64, count: u64) -> bool {
        self.tables.forget(inode, count, Instant::now())
    }

    fn holds(&self, inode: u64) -> bool {
        self.tables.holds(inode)
    }

    fn uncache(&self, inode: u64) {
        self.tables.uncache(inode);
    }

    /// The inodes gone with the name.
    fn drop_name(&self, parent: u64, name: &[u8]) -> Vec<u64> {
        let mut gone = Vec::new();
        self.tables.drop_name(parent, name, &mut gone);
        gone
    }

    /// The files of blocks `first..=last` of `inode` (those not named:
    /// none), and the file of all its bytes, if there is one.
    #[allow(clippy::too_many_arguments)] // the blocks' span and their files, field by field
    fn set_blocks(
        &self,
        inode: u64,
        size: u64,
        block_size: u64,
        first: u64,
        last: u64,
        files: Vec<BlockFileFields>,
        whole: Option<WholeFields>,
    ) -> PyResult<()> {
        if block_size == 0 {
            return Err(PyValueError::new_err("block_size must be positive"));
        }
        let files = files
            .into_iter()
            .map(|(index, path, offset, dev, ino, ctime_ns, tier)| {
                let identity = FileIdentity { dev, ino, ctime_ns };
                let tier = Arc::from(tier);
                (
                    index,
                    BlockFile {
                        path,
                        offset,
                        identity,
                        tier,
                    },
                )
            })
            .collect();
        let whole = whole.map(|(path, dev, ino, ctime_ns, tier)| BlockFile {
            path,
            offset: 0,
            identity: FileIdentity { dev, ino, ctime_ns },
            tier: Arc::from(tier),
        });
        self.tables.set_blocks(
            inode,
            size,
            block_size,
            first..last.saturating_add(1),
            files,
            whole,
        );
        Ok(())
    }

    /// Listing `handle` of `directory` as OPENDIR found it (`.` and `..`
    /// first), which the native workers read; its entries' inodes stay
    /// until it is released.
    fn set_listing(&self, handle: u64, directory: u64, entries: Vec<ListedFields>) {
        let entries = entries
            .into_iter()
            .map(|(name, inode, attributes, cacheable)| Listed {
                name,
                inode,
                attr: attr(attributes),
                cacheable,
            })
            .collect();
        self.tables.set_listing(handle, directory, entries);
    }

    /// Listing `handle` was released without the kernel (an OPENDIR
    /// interrupted); the inodes gone with it.
    fn release_listing(&self, handle: u64) -> Vec<u64> {
        let mut gone = Vec::new();
        self.tables
            .release_listing(handle, Instant::now(), &mut gone);
        gone
    }

    /// What was reported since the last drain, once there is something or
    /// `timeout` seconds passed.
    fn drain(&self, py: Python<'_>, timeout: f64) -> Drained {
        let timeout = Duration::try_from_secs_f64(timeout).unwrap_or(Duration::ZERO);
        let (tables, reports) = (Arc::clone(&self.tables), Arc::clone(&self.reports));
        let pending = py.detach(move || {
            let mut gone = Vec::new();
            tables.sweep(Instant::now(), &mut gone);
            reports.forgotten(gone);
            reports.wait(timeout)
        });
        let reads = pending
            .reads
            .into_iter()
            .map(|read| {
                let served = read
                    .served
                    .into_iter()
                    .map(|(tier, bytes)| (tier.to_string(), bytes))
                    .collect();
                (
                    read.inode,
                    read.offset,
                    read.size,
                    read.pid,
                    served,
                    read.seconds,
                )
            })
            .collect();
        let opens = pending
            .opens
            .into_iter()
            .map(|open| (open.inode, open.pid, open.tier.to_string()))
            .collect();
        let answered = reports::ANSWERED
            .iter()
            .zip(pending.answered)
            .filter(|(_, count)| *count > 0)
            .map(|(name, count)| (*name, count))
            .collect();
        (reads, opens, pending.forgotten, answered)
    }
}

#[pyclass(frozen, name = "Session", module = "cachefsd._native")]
struct PySession {
    session: Arc<session::Session>,
}

#[pymethods]
impl PySession {
    #[new]
    fn new(
        fd: i32,
        tables: &PyTables,
        writable: bool,
        workers: usize,
        request_buffer: usize,
    ) -> PyResult<Self> {
        let session = session::Session::start(
            fd,
            Arc::clone(&tables.tables),
            Arc::clone(&tables.reports),
            writable,
            workers,
            request_buffer,
        )?;
        Ok(PySession {
            session: Arc::new(session),
        })
    }

    /// The next request only Python answers, as (descriptor to answer
    /// through, the request's bytes); None once the session ended.
    fn next_request<'py>(&self, py: Python<'py>) -> Option<(i32, Bound<'py, PyBytes>)> {
        let session = Arc::clone(&self.session);
        let handed = py.detach(move || session.next_request())?;
        Some((handed.fd, PyBytes::new(py, &handed.message)))
    }

    fn stop(&self) {
        self.session.stop();
    }

    /// How the native workers answer OPEN: "python" (they hand it on),
    /// "through", "cached" or "no-open" (`session::OpenMode`).
    fn set_open_mode(&self, mode: &str) -> PyResult<()> {
        let mode = match mode {
            "python" => OpenMode::Python,
            "through" => OpenMode::Through,
            "cached" => OpenMode::Cached,
            "no-open" => OpenMode::NoOpen,
            _ => return Err(PyValueError::new_err(format!("no open mode {mode:?}"))),
        };
        self.session.set_open_mode(mode);
        Ok(())
    }

    /// Open `inode` (a `staged` file's, else a version's) by the
    /// passthrough rules: the backing id to answer with, or None for a
    /// cached open; OSError EBUSY if the inode is open on the other kind
    /// of file. `find()` is asked for the file of its bytes, as
    /// (descriptor, tier) or None, when the rules need it; the caller
    /// closes that descriptor. `waiting()` is called before this waits
    /// for another open's find.
    fn open(
        &self,
        py: Python<'_>,
        inode: u64,
        find: Bound<'_, PyAny>,
        staged: bool,
        waiting: Bound<'_, PyAny>,
    ) -> PyResult<Option<u32>> {
        let opens = self.session.opens();
        let mut begun = opens.begin(inode, false, staged);
        if begun == Begin::BeingFound {
            waiting.call0()?;
            let waiter = Arc::clone(&opens);
            begun = py.detach(move || waiter.begin(inode, true, staged));
        }
        let opened = match begun {
            Begin::Decided(opened) => opened,
            Begin::BeingFound => unreachable!("a waiting open is never told to wait"),
            Begin::Busy => {
                return Err(PyOSError::new_err((
                    libc::EBUSY,
                    "the file is open on another of its files",
                )))
            }
            Begin::Find => {
                let found = find
                    .call0()
                    .and_then(|found| found.extract::<Option<(i32, String)>>());
                let found = match found {
                    Ok(found) => found,
                    Err(error) => {
                        opens.abandon(inode);
                        return Err(error);
                    }
                };
                let found = found.map(|(fd, tier)| (fd, Arc::from(tier)));
                let finishing = Arc::clone(&opens);
                py.detach(move || finishing.finish(inode, found, staged))
            }
        };
        Ok(match opened {
            Opened::Cached => None,
            Opened::Through(backing) => Some(backing.id),
        })
    }

    /// An open of `inode` is to stage its version to write it: false if the
    /// version is open on its cache file; else new opens of the version are
    /// cached ones until `end_writer`.
    fn begin_writer(&self, py: Python<'_>, inode: u64) -> bool {
        let opens = self.session.opens();
        py.detach(move || opens.begin_writer(inode))
    }

    fn end_writer(&self, inode: u64) {
        self.session.opens().end_writer(inode);
    }

    /// An open of `inode` Python answered was released (`through`: a passthrough one).
    fn release(&self, py: Python<'_>, inode: u64, through: bool) {
        let opens = self.session.opens();
        py.detach(move || opens.release(inode, through));
    }

    /// Whether any inode has a passthrough open.
    fn passing_through(&self) -> bool {
        self.session.opens().passing_through()
    }

    /// Register `fd` as a backing file and close it again: whether the
    /// kernel takes the cache's files, known at mount.
    fn check_backing(&self, fd: i32) -> PyResult<()> {
        Ok(self.session.opens().check_backing(fd)?)
    }

    fn join(&self, py: Python<'_>) {
        let session = Arc::clone(&self.session);
        py.detach(move || session.join());
    }

    #[getter]
    fn failure(&self) -> Option<String> {
        self.session.failure()
    }
}

#[pymodule]
fn _native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<PyTables>()?;
    module.add_class::<PySession>()?;
    Ok(())
}
