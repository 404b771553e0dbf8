//! Which Unix user owns the other end of a TCP connection, when that end is
//! on this host (in this network namespace).
//!
//! `SO_PEERCRED` exists only for Unix sockets; for TCP the kernel lists
//! every socket of the namespace with its owner in `/proc/net/tcp` and
//! `/proc/net/tcp6`. The client's socket is the entry whose local address
//! is our peer's and whose remote address is ours. A peer on another host
//! is not listed: `None`, and the caller relies on what the client reports.

#![forbid(unsafe_code)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The uid owning the socket at `peer` connected to our `local`, if that
/// socket is on this host.
pub fn socket_owner(local: SocketAddr, peer: SocketAddr) -> Option<u32> {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .find_map(|text| owner_in_table(&text, local, peer))
}

/// The uid in a `/proc/net/tcp{,6}` table of the socket bound to `peer`
/// and connected to `local`.
fn owner_in_table(text: &str, local: SocketAddr, peer: SocketAddr) -> Option<u32> {
    text.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (own, remote, uid) = (fields.get(1)?, fields.get(2)?, fields.get(7)?);
        (same_endpoint(parse_endpoint(own)?, peer) && same_endpoint(parse_endpoint(remote)?, local))
            .then(|| uid.parse().ok())
            .flatten()
    })
}

/// Equal addresses, counting an IPv4-mapped IPv6 address as its IPv4 one.
fn same_endpoint(a: SocketAddr, b: SocketAddr) -> bool {
    let plain = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    a.port() == b.port() && plain(a.ip()) == plain(b.ip())
}

/// `0100007F:1F90` (IPv4) or 32 hex digits and a port (IPv6): the address
/// words are in host byte order (little-endian here), the port big-endian.
fn parse_endpoint(text: &str) -> Option<SocketAddr> {
    let (address, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |hex: &str| u32::from_str_radix(hex, 16).ok().map(|w| w.to_le_bytes());
    let ip = match address.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(address)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_exact_mut(4).enumerate() {
                chunk.copy_from_slice(&word(address.get(i * 8..i * 8 + 8)?)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_kernel_table() {
        let table =
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
             0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n\
             1: 0100007F:C350 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1234        0 2 1\n";
        let server: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let client: SocketAddr = "127.0.0.1:50000".parse().unwrap();
        assert_eq!(owner_in_table(table, server, client), Some(1234));
        assert_eq!(owner_in_table(table, server, "127.0.0.1:50001".parse().unwrap()), None);
        let v6 = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid\n\
             0: 0000000000000000FFFF00000100007F:C350 0000000000000000FFFF00000100007F:1F90 01 00000000:00000000 00:00000000 00000000   77\n";
        assert_eq!(owner_in_table(v6, server, client), Some(77));
    }

    #[test]
    fn finds_the_owner_of_a_real_loopback_connection() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server_side, peer) = listener.accept().unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        let me = nix::unistd::geteuid().as_raw();
        assert_eq!(socket_owner(server_side.local_addr().unwrap(), peer), Some(me));
    }
}
