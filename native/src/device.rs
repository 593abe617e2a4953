//! The kernel edge: descriptors of one FUSE connection, its backing files,
//! the eventfd that ends its workers, and the page-cache advice on cache files. The only
//! `unsafe` code of the crate is here, each block with what makes it sound.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::opens::BackingFiles;

/// `FUSE_DEV_IOC_CLONE`: `_IOR(229, 0, uint32_t)`.
const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_E500;
/// `FUSE_DEV_IOC_BACKING_OPEN`: `_IOW(229, 1, struct fuse_backing_map)`.
const FUSE_DEV_IOC_BACKING_OPEN: libc::c_ulong = 0x4010_E501;
/// `FUSE_DEV_IOC_BACKING_CLOSE`: `_IOW(229, 2, uint32_t)`.
const FUSE_DEV_IOC_BACKING_CLOSE: libc::c_ulong = 0x4004_E502;

/// `struct fuse_backing_map`: the file to back an inode with.
#[repr(C)]
struct BackingMap {
    fd: i32,
    flags: u32,
    padding: u64,
}

fn check(result: libc::c_int) -> io::Result<libc::c_int> {
    if result < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

/// A new descriptor of the connection `session_fd` belongs to, non-blocking:
/// the kernel queues requests to all of a connection's descriptors alike,
/// and a request's answer goes back through the descriptor it was read
/// from. Where /dev/fuse cannot be opened again (a user without access to
/// it, who mounted through fusermount3), a duplicate of `session_fd`
/// serves: the workers then share one queue of answers.
pub fn clone_connection(session_fd: RawFd) -> io::Result<File> {
    let device = match File::options().read(true).write(true).open("/dev/fuse") {
        Ok(device) => device,
        Err(error) if error.kind() == io::ErrorKind::PermissionDenied => {
            return duplicate(session_fd)
        }
        Err(error) => return Err(error),
    };
    let session =
        u32::try_from(session_fd).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: the ioctl reads one u32 through the pointer, which points at a
    // live local; the descriptor is the open device just made.
    check(unsafe {
        libc::ioctl(
            device.as_raw_fd(),
            FUSE_DEV_IOC_CLONE,
            &session as *const u32,
        )
    })?;
    // SAFETY: fcntl on a descriptor this function owns, with integer arguments only.
    let flags = check(unsafe { libc::fcntl(device.as_raw_fd(), libc::F_GETFL) })?;
    // SAFETY: as above.
    check(unsafe { libc::fcntl(device.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) })?;
    Ok(device)
}

/// A second descriptor of `session_fd`'s open file (non-blocking, as the
/// mount made it), closed on exec.
fn duplicate(session_fd: RawFd) -> io::Result<File> {
    // SAFETY: fcntl with integer arguments; it returns a new descriptor or -1.
    let fd = check(unsafe { libc::fcntl(session_fd, libc::F_DUPFD_CLOEXEC, 0) })?;
    // SAFETY: `fd` was just made by fcntl and nothing else owns it.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// The connection's backing files (FUSE passthrough), registered through
/// a descriptor of its own.
pub struct Backing {
    device: File,
}

impl Backing {
    pub fn new(session_fd: RawFd) -> io::Result<Self> {
        Ok(Backing {
            device: duplicate(session_fd)?,
        })
    }
}

impl BackingFiles for Backing {
    /// Register `fd` as a backing file: the id an OPEN answer names it by.
    fn register(&self, fd: RawFd) -> io::Result<u32> {
        let map = BackingMap {
            fd,
            flags: 0,
            padding: 0,
        };
        // SAFETY: the ioctl reads one `fuse_backing_map` (the kernel's
        // layout, `repr(C)`) through the pointer, which points at a live
        // local; the kernel takes its own reference to `fd`'s file.
        let id = check(unsafe {
            libc::ioctl(
                self.device.as_raw_fd(),
                FUSE_DEV_IOC_BACKING_OPEN,
                &map as *const BackingMap,
            )
        })?;
        Ok(id as u32)
    }

    fn unregister(&self, backing_id: u32) -> io::Result<()> {
        // SAFETY: the ioctl reads one u32 through the pointer, which points at a live local.
        check(unsafe {
            libc::ioctl(
                self.device.as_raw_fd(),
                FUSE_DEV_IOC_BACKING_CLOSE,
                &backing_id as *const u32,
            )
        })?;
        Ok(())
    }
}

/// An eventfd that, once signalled, stays readable: it wakes every worker.
pub fn event() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes integers and returns a new descriptor or -1.
    let fd = check(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
    // SAFETY: `fd` was just returned by eventfd and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub fn signal(event: &OwnedFd) -> io::Result<()> {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes the 8 bytes of a live local to a descriptor we own.
    let written = unsafe { libc::write(event.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    if written < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What a worker waits on: its descriptor of the connection, for a
/// request, and the session's end. Every descriptor of a connection waits
/// on the connection's one queue: each waits exclusively, so a request
/// wakes one worker, not all of them.
pub struct Waiter {
    epoll: OwnedFd,
}

/// The epoll key of the session's end (the device's is 0).
const END: u64 = 1;

impl Waiter {
    pub fn new(device: &File, end: &OwnedFd) -> io::Result<Self> {
        // SAFETY: epoll_create1 takes a flag and returns a new descriptor or -1.
        let fd = check(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: `fd` was just made by epoll_create1 and nothing else owns it.
        let epoll = unsafe { OwnedFd::from_raw_fd(fd) };
        let waiter = Waiter { epoll };
        waiter.add(device.as_raw_fd(), libc::EPOLLIN | libc::EPOLLEXCLUSIVE, 0)?;
        waiter.add(end.as_raw_fd(), libc::EPOLLIN, END)?;
        Ok(waiter)
    }

    fn add(&self, fd: RawFd, events: libc::c_int, key: u64) -> io::Result<()> {
        let mut event = libc::epoll_event {
            events: events as u32,
            u64: key,
        };
        // SAFETY: epoll_ctl reads one epoll_event through the pointer, which
        // points at a live local; both descriptors are open.
        check(unsafe {
            libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event)
        })?;
        Ok(())
    }

    /// Wait until the device has a request or the session ended; true for a request.
    pub fn wait(&self) -> io::Result<bool> {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 2];
        loop {
            // SAFETY: epoll_wait writes at most `events.len()` entries into
            // the live local array it is given.
            let ready = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    events.as_mut_ptr(),
                    events.len() as libc::c_int,
                    -1,
                )
            };
            if ready >= 0 {
                let ready = &events[..ready as usize];
                return Ok(!ready.iter().any(|event| event.u64 == END));
            }
            let error = io::Error::last_os_error();
            if error.kind() != io::ErrorKind::Interrupted {
                return Err(error);
            }
        }
    }
}

/// Tell the kernel that `length` bytes of `file` from `offset` need not stay
/// in RAM: the mounted file's own pages now hold them.
pub fn drop_pages(file: &File, offset: u64, length: usize) {
    let (Ok(offset), Ok(length)) = (libc::off_t::try_from(offset), libc::off_t::try_from(length))
    else {
        return;
    };
    // SAFETY: advice on a descriptor we own, with integer arguments; its
    // failure only leaves the pages cached.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), offset, length, libc::POSIX_FADV_DONTNEED) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `_IOC(direction, 229, number, size)`, as `<asm-generic/ioctl.h>` lays it out.
    fn fuse_ioctl(direction: libc::c_ulong, number: libc::c_ulong, size: usize) -> libc::c_ulong {
        (direction << 30) | ((size as libc::c_ulong) << 16) | (229 << 8) | number
    }

    #[test]
    fn the_ioctl_numbers_are_the_kernels() {
        const WRITE: libc::c_ulong = 1;
        const READ: libc::c_ulong = 2;
        assert_eq!(std::mem::size_of::<BackingMap>(), 16);
        assert_eq!(FUSE_DEV_IOC_CLONE, fuse_ioctl(READ, 0, 4));
        assert_eq!(FUSE_DEV_IOC_BACKING_OPEN, fuse_ioctl(WRITE, 1, 16));
        assert_eq!(FUSE_DEV_IOC_BACKING_CLOSE, fuse_ioctl(WRITE, 2, 4));
    }
}
