//! Device buffers (dma-buf) without an RDMA link: built without the `rdma` feature, or with
//! it on a host without a device, or before `connect_all`, registering one is an
//! `Unsupported` error that names the verb and says there is no RDMA device. (With a device
//! and a provider without dma-buf support, see `rdma.rs`, run in the soft-RoCE guest.)

use std::net::{IpAddr, Ipv4Addr};

use ciera_transport::{DmaBuf, Endpoint, TransportError};

#[test]
fn registering_a_device_buffer_without_rdma_says_no_rdma_device() {
    let mut ep = Endpoint::bind(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
    let buf = DmaBuf {
        fd: -1,
        offset: 0,
        len: 1 << 20,
        iova: 0,
    };
    let e = ep.register_dmabuf(&buf).unwrap_err();
    assert!(matches!(e, TransportError::Unsupported { .. }), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("device buffers need dma-buf support (ibv_reg_dmabuf_mr): no RDMA device"),
        "{text}"
    );
    if !cfg!(feature = "rdma") {
        assert!(text.contains("rdma feature"), "{text}");
    }
}
