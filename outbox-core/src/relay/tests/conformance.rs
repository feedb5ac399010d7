//! The in-memory store and the scripted publisher pass the conformance suites that every adapter
//! runs against itself.

use std::sync::Arc;

use async_trait::async_trait;

use crate::testkit::{MemoryStore, ScriptedPublisher};

struct MemoryFixture;

#[async_trait]
impl crate::testkit::StoreFixture for MemoryFixture {
    async fn store(&self) -> Arc<dyn crate::testkit::TestStore> {
        Arc::new(MemoryStore::new())
    }
}

#[tokio::test]
async fn memory_store_passes_the_store_conformance_suite() {
    crate::testkit::store_suite::run_all(&MemoryFixture).await;
}

#[tokio::test]
async fn scripted_publisher_passes_the_publisher_conformance_suite() {
    crate::testkit::publisher_suite::run_all(&ScriptedPublisher::new()).await;
}
