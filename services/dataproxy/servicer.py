"""The DataProxy gRPC service: glue between protobuf, the session store and the turn ledger."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc

from protos import common_pb2, dataproxy_pb2, dataproxy_pb2_grpc
from services.dataproxy.ledger_streams import LedgerStreams
from services.dataproxy.sessions import SessionStore

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class DataProxyServicer(dataproxy_pb2_grpc.DataProxyServicer):
    """Sessions, rewards and the turn ledger over gRPC."""

    def __init__(self, *, store: SessionStore, ledger: LedgerStreams) -> None:
        self._store = store
        self._ledger = ledger
        # Where Ledger is also served framed (0: it is not).
        self.framed_port = 0

    async def StartSession(
        self, request: dataproxy_pb2.StartSessionRequest, context: Context
    ) -> dataproxy_pb2.StartSessionResponse:
        started = await self._store.start(
            task_id=request.task_id, api_key=request.api_key, group_size=request.group_size
        )
        return dataproxy_pb2.StartSessionResponse(
            session_id=started.session_id,
            api_key=started.api_key,
            refreshed=started.refreshed,
            ended_trajectory_id=started.ended_trajectory_id,
            group_id=started.group_id,
            members=[
                dataproxy_pb2.GroupMember(session_id=sid, api_key=key)
                for sid, key in started.members
            ],
        )

    async def SetReward(
        self, request: dataproxy_pb2.SetRewardRequest, context: Context
    ) -> dataproxy_pb2.SetRewardResponse:
        interaction_id = await self._store.set_reward(
            request.key_digest,
            reward=request.reward,
            interaction_id=request.interaction_id,
            session_id=request.session_id,
        )
        return dataproxy_pb2.SetRewardResponse(interaction_id=interaction_id)

    async def EndSession(
        self, request: dataproxy_pb2.EndSessionRequest, context: Context
    ) -> dataproxy_pb2.EndSessionResponse:
        ended = await self._store.end(request.key_digest, session_id=request.session_id)
        return dataproxy_pb2.EndSessionResponse(
            session_id=ended.session_id,
            trajectory_id=ended.trajectory_id,
            interaction_count=ended.interaction_count,
        )

    async def Ledger(
        self, request_iterator: AsyncIterator[dataproxy_pb2.LedgerRequests], context: Context
    ) -> AsyncIterator[dataproxy_pb2.LedgerResponses]:
        async for answer in self._ledger.serve(request_iterator):
            yield answer

    async def LedgerEndpoint(
        self, request: common_pb2.FramedEndpointRequest, context: Context
    ) -> common_pb2.FramedEndpointResponse:
        return common_pb2.FramedEndpointResponse(port=self.framed_port)

    async def IssueKey(
        self, request: dataproxy_pb2.IssueKeyRequest, context: Context
    ) -> dataproxy_pb2.IssueKeyResponse:
        issued = await self._store.issue_key(task_id=request.task_id, mode=request.mode)
        return dataproxy_pb2.IssueKeyResponse(
            api_key=issued.api_key, key_id=issued.key_id, mode=issued.mode
        )

    async def ResolveKey(
        self, request: dataproxy_pb2.ResolveKeyRequest, context: Context
    ) -> dataproxy_pb2.ResolveKeyResponse:
        key = await self._store.resolve(request.key_digest)
        return dataproxy_pb2.ResolveKeyResponse(
            key_id=key.key_id, session_id=key.episode if key.active else "", mode=key.mode
        )

    async def GetHistory(
        self, request: dataproxy_pb2.GetHistoryRequest, context: Context
    ) -> dataproxy_pb2.GetHistoryResponse:
        history = await self._store.history(request.key_digest)
        return dataproxy_pb2.GetHistoryResponse(
            session_id=history.session_id,
            entries=[
                dataproxy_pb2.HistoryEntry(interaction_id=iid, interaction_json=data)
                for iid, data in history.entries
            ],
        )
