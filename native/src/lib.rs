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
//!   takes from it the requests only Python answers, one a call.
//!
//! Every call that may wait releases the GIL. `abi`, the decoding of the
//! kernel's requests, is public for the fuzz target (`fuzz/`).

pub mod abi;
mod device;
mod reports;
mod session;
mod tables;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::abi::Attr;
use crate::reports::Reports;
use crate::tables::{BlockFile, FileIdentity};

/// `protocol.Attr`'s fields, in order: ino, size, mtime, mode, nlink, uid, gid.
type AttrFields = (u64, u64, f64, u32, u32, u32, u32);
/// A block's verified raw file: index, path, offset of the block in it,
/// the file's device, inode and ctime (ns), and its tier's name.
type BlockFileFields = (u64, PathBuf, u64, u64, u64, i64, String);
/// A read served natively: inode, offset, size, pid, bytes by tier, seconds.
type ReadFields = (u64, u64, u64, u32, Vec<(String, u64)>, f64);
/// What `Tables.drain` returns: reads, inodes gone, requests answered by operation.
type Drained = (Vec<ReadFields>, Vec<u64>, Vec<(&'static str, u64)>);

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

    /// The files of blocks `first..=last` of `inode` (those not named: none).
    #[allow(clippy::too_many_arguments)] // the blocks' span and their files, field by field
    fn set_blocks(
        &self,
        inode: u64,
        size: u64,
        block_size: u64,
        first: u64,
        last: u64,
        files: Vec<BlockFileFields>,
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
        self.tables.set_blocks(
            inode,
            size,
            block_size,
            first..last.saturating_add(1),
            files,
        );
        Ok(())
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
        let answered = reports::ANSWERED
            .iter()
            .zip(pending.answered)
            .filter(|(_, count)| *count > 0)
            .map(|(name, count)| (*name, count))
            .collect();
        (reads, pending.forgotten, answered)
    }
}

#[pyclass(frozen, name = "Session", module = "cachefsd._native")]
struct PySession {
    session: Arc<session::Session>,
}

#[pymethods]
impl PySession {
    #[new]
    fn new(fd: i32, tables: &PyTables, workers: usize, request_buffer: usize) -> PyResult<Self> {
        let session = session::Session::start(
            fd,
            Arc::clone(&tables.tables),
            Arc::clone(&tables.reports),
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
