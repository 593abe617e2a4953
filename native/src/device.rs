//! The kernel edge: descriptors of one FUSE connection, the eventfd that
//! ends its workers, and the page-cache advice on cache files. The only
//! `unsafe` code of the crate is here, each block with what makes it sound.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// `FUSE_DEV_IOC_CLONE`: `_IOR(229, 0, uint32_t)`.
const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_E500;

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

/// Wait until `device` has a request or `event` was signalled; true for a request.
pub fn wait(device: &File, event: &OwnedFd) -> io::Result<bool> {
    let mut fds = [
        libc::pollfd {
            fd: device.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: event.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: poll reads and writes the two entries of a live local array
        // whose length it is given.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if ready >= 0 {
            return Ok(fds[1].revents == 0);
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
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
